"""The tracer's folder, put first on PYTHONPATH of a [program] command (its files import nothing of batchsweep)."""
from pathlib import Path

FOLDER = Path(__file__).parent
