"""The ``lightning-ppo`` console script: :func:`lightning_ppo.cli.main`, with Ctrl-C answered from
the first moment (importing torch, transformers and Lightning takes seconds, more on a network
filesystem; a Ctrl-C then used to print a traceback from deep inside one of them)."""

from __future__ import annotations

import sys

from lightning_ppo.runs.ctrl_c import ctrl_c_exits


def main() -> int | None:
    with ctrl_c_exits():
        if sys.argv[1:2] == ["serve"]:  # becomes the vLLM server: none of the trainer's imports
            from lightning_ppo.runs.errors import usage_errors_exit
            from lightning_ppo.serve import main as serve_main

            with usage_errors_exit("lightning-ppo serve"):
                serve_main(sys.argv[2:])
            return None
        from lightning_ppo.cli import main as cli_main  # the heavy imports

        return cli_main()


if __name__ == "__main__":
    sys.exit(main())
