"""Linux-side checks of the MPS host code (csrc/mps/): see syntax_check.py."""
