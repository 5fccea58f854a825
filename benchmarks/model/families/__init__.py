"""The model's kernel families: each prices one family from core/ and prints
its report; the command (cli.py) runs them. A family may use another family
(splitd uses d512, splitd_mla uses decode_wide), never the command."""
