"""``python -m sglang_ext.eval --url URL``: see sglang_ext.eval.cli and docs/eval.md."""

import sys

from sglang_ext.eval.cli import main

sys.exit(main())
