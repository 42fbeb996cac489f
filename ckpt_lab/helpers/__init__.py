"""Notebook helpers, not part of any checkpoint: ``show`` renders the package's own source in a
notebook, ``viz`` draws autograd graphs and memory plots, ``processes`` starts worker processes for
notebook 06. And ``in_checkout``, for the commands that rewrite the site's results (figures and tables)."""

from pathlib import Path

# The checkout this package lives in, when installed editable (``make setup``): ckpt_lab/helpers/..
_CHECKOUT = Path(__file__).resolve().parents[2]


def in_checkout(*parts: str) -> Path:
    """A path inside the checkout (``in_checkout("images")``), for the commands that rewrite the
    site's results pages (figures, tables); a clear error where the package is not installed from one."""
    if not (_CHECKOUT / "README.md").is_file() or not (_CHECKOUT / "ckpt_lab").is_dir():
        raise RuntimeError(
            f"ckpt_lab is not installed from its checkout ({_CHECKOUT} has no README.md and ckpt_lab/), "
            "so there are no results pages to rewrite. Run this from a clone, after `make setup`."
        )
    return _CHECKOUT.joinpath(*parts)
