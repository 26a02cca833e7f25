"""``python -m flexpack.integrations.litgpt finetune CHECKPOINT_DIR ...`` (see ``--help``)."""

import sys

from flexpack.integrations.litgpt.finetune import main

sys.exit(main())
