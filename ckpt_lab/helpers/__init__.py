"""Notebook helpers, not part of any checkpoint: ``show`` renders the package's own source in a
notebook, ``viz`` draws autograd graphs and memory plots, ``processes`` starts worker processes for
notebook 06."""
