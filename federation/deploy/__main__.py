"""``python -m federation.deploy demo ...`` (``federation.deploy.cli``)."""

import sys

from federation.deploy.cli import main

sys.exit(main())
