"""`python -m hardy`: the command line, and how torchrun starts `--tp` workers."""
import os
import sys

from hardy.cli.main import main

code = main()
distributed = sys.modules.get("hardy.parallel.distributed")
if distributed is not None and distributed.left_together():
    # A worker that met its peers and destroyed its process group skips interpreter finalization: the
    # model's row-parallel layers still hold the gloo group, and its threads torn down there aborted a
    # worker now and then ('terminate called without an active exception', pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
