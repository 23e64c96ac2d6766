"""torchrun's elastic agent for one replica group of a live run: `python -m hardy.fault.agent ARGS` takes
torchrun's arguments and behaves as `python -m torch.distributed.run ARGS`, except that it ends without
the interpreter's teardown once its workers are gone (the launcher waits for every group's agent)."""
from __future__ import annotations

import traceback

from hardy.fast_exit import exit_now


def main() -> None:
    from torch.distributed.run import main as torchrun  # start-up time: only the agent needs it

    try:
        torchrun()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # as the interpreter would report it: the traceback, exit 1
        traceback.print_exc()
        code = 1
    else:
        code = 0
    exit_now(code)


if __name__ == "__main__":
    main()
