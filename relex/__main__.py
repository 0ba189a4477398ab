import sys

from relex.cli import main

sys.exit(main())
