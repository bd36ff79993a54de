import sys

from smoe.cli.commands import main

sys.exit(main())
