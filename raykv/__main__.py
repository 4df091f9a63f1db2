import sys

from raykv.cli import main

sys.exit(main())
