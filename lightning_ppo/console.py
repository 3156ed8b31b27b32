"""The ``lightning-ppo`` console script: :func:`lightning_ppo.cli.main`, with Ctrl-C answered from
the first moment (importing torch, transformers and Lightning takes seconds, more on a network
filesystem; a Ctrl-C then used to print a traceback from deep inside one of them)."""

from __future__ import annotations

import sys

from lightning_ppo.runs.ctrl_c import ctrl_c_exits


def main() -> int | None:
    with ctrl_c_exits():
        from lightning_ppo.cli import main as cli_main  # the heavy imports

        return cli_main()


if __name__ == "__main__":
    sys.exit(main())
