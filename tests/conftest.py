import sys
from pathlib import Path

# Make tests/helpers.py importable as `helpers` under every pytest import mode.
sys.path.insert(0, str(Path(__file__).parent))
