import sys

from estimator.cli import main

sys.exit(main())
