"""The interleaved speed trial: ``python -m amp_exp.speed`` and the trial at the end of a sweep."""
