"""`python -m hardy`: the command line, and how torchrun starts `--tp` workers."""
import sys

from hardy import fast_exit
from hardy.cli.main import main
from hardy.fast_exit import exit_now

code = main()
distributed = sys.modules.get("hardy.parallel.distributed")
if distributed is not None and distributed.left_together():
    # A worker that met its peers and destroyed its process group skips interpreter finalization: the
    # model's row-parallel layers still hold the gloo group, and its threads torn down there aborted a
    # worker now and then ('terminate called without an active exception', pytorch/pytorch#179291).
    exit_now(code)
if fast_exit.requested():  # a launcher whose workers have exited: nothing left to finalize
    exit_now(code)
raise SystemExit(code)
