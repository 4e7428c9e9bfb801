import sys

from torchnext.cli import main

sys.exit(main())
