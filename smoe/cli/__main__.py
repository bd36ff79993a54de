import sys

from smoe.cli import main

sys.exit(main())
