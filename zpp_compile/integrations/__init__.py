"""zeropp inside the training frameworks users already run; each module imports its framework
only when imported itself (`pip install zeropp[hf]` and so on)."""
