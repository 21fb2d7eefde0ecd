"""The `llamascope` command (pyproject's console script): `llamascope serve [MODEL] [flags]`, as `vllm serve MODEL`
is typed, and `llamascope generate`. `python -m service` and `python -m model.generate` stay what they are: each
subcommand hands the rest of its command line to one of them."""

from __future__ import annotations

import sys

USAGE = """usage: llamascope {serve,generate} ...

  serve [MODEL] [flags]   the OpenAI-compatible server (`llamascope serve --help`; docs/configuration.md)
  generate [flags]        one prompt answered on the command line (`llamascope generate --help`)
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command, rest = (args[0], args[1:]) if args else ("", [])
    if command == "serve":
        from service.main import exit_now
        from service.main import main as serve

        exit_now(serve(rest, prog="llamascope serve"))
    if command == "generate":
        from model.generate import main as generate

        return generate(rest, prog="llamascope generate")
    if command in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    print(USAGE + (f"\nllamascope: error: unknown command {command!r}\n" if command else ""), end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
