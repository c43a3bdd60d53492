"""The long-run forecast: a run's signals (training/signals.py) extrapolated to a planned length,
and the first limit one is forecast to cross (``python -m amp_exp.forecast``)."""
