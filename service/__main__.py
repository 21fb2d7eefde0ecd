import sys

from service.main import main

sys.exit(main())
