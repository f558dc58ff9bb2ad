"""torchrun entry for tests/test_resume.py: dtlib.experiments.resilience's drill (see its main)."""
from dtlib.experiments.resilience import main

if __name__ == "__main__":
    main()
