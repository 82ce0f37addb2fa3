import sys
from pathlib import Path

# e2e helpers live beside the tests
sys.path.insert(0, str(Path(__file__).parent))
