import logging
import os
import sys

from service.main import main

code = main()
# Everything is stopped and flushed by now (uvicorn's shutdown, the lifespan's engine stop). Skip the interpreter's
# teardown of torch, which takes seconds on a busy machine, so a SIGTERM'd server exits within its grace period.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
