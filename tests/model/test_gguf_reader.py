"""model/loaders/gguf_reader.py against the `gguf` package's GGUFReader (the reference): the same metadata values,
the same tensor directory and the same bytes, on the default model's file and on a file with every metadata value
type; a file cut short is refused with the tensor and byte counts. model/loaders/ggml_types.py's table of types and
block sizes against the package's."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from model.loaders import CheckpointError, default_model_path
from model.loaders.gguf_reader import GGUFFile


def _same_as_reference(path) -> GGUFFile:
    ours, ref = GGUFFile(path), GGUFReader(path)
    assert ours.metadata == {k: f.contents() for k, f in ref.fields.items()}
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8))
    return ours


def test_the_default_model_reads_as_the_gguf_package_reads_it():
    f = _same_as_reference(default_model_path())
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152


def test_every_value_type_and_tensor_kind(tmp_path):
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("a.u8", 7); w.add_int8("a.i8", -7); w.add_uint16("a.u16", 65000); w.add_int16("a.i16", -3)
    w.add_uint32("a.u32", 4_000_000_000); w.add_int32("a.i32", -5); w.add_float32("a.f32", 0.25)
    w.add_uint64("a.u64", 2**40); w.add_int64("a.i64", -(2**40)); w.add_float64("a.f64", 1e-300)
    w.add_bool("a.bool", True); w.add_string("a.str", "héllo")
    w.add_array("a.ints", [1, 2, 3]); w.add_array("a.floats", [0.5, -1.5]); w.add_array("a.strs", ["x", "", "zé"])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("q8", rng.integers(0, 255, (4, 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    f = _same_as_reference(path)
    assert f.metadata["a.strs"] == ["x", "", "zé"] and f.metadata["a.u64"] == 2**40


def test_a_cut_file_names_the_tensor_and_the_bytes(tmp_path):
    data = default_model_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"file is truncated: .* but the file has {len(data) // 2} bytes"):
        GGUFFile(cut)
    cut.write_bytes(data[:100_000])  # inside the vocabulary
    with pytest.raises(CheckpointError, match=r"cannot read GGUF \(truncated or not a GGUF file\?\)"):
        GGUFFile(cut)


def test_the_type_table_is_the_gguf_packages_and_its_float_types_dequantize_as_the_package_does():
    import gguf
    from gguf.quants import dequantize as reference

    from model.loaders import ggml_types

    assert {t.name: int(t) for t in ggml_types.GGMLQuantizationType} == {t.name: int(t) for t in GGMLQuantizationType}
    assert {t.name: s for t, s in ggml_types.GGML_QUANT_SIZES.items()} == \
           {t.name: s for t, s in gguf.GGML_QUANT_SIZES.items()}
    rng = np.random.default_rng(0)
    for name, data in (("F32", rng.standard_normal((3, 8)).astype(np.float32)),
                       ("F16", rng.standard_normal((3, 8)).astype(np.float16)),
                       ("Q8_0", rng.integers(0, 255, (3, 34), dtype=np.uint8))):
        ours = ggml_types.dequantize(data, ggml_types.GGMLQuantizationType[name])
        ref = reference(data, GGMLQuantizationType[name])
        assert ours.dtype == np.float32 and np.array_equal(ours, ref, equal_nan=True)
