"""Runs trained outside amp_exp's engine, recorded in its results format (docs/integrations.md):
``amp_exp.record`` for a plain loop or Accelerate, ``integrations.transformers.AmpExpCallback``
for the Hugging Face Trainer, ``integrations.lightning.AmpExpCallback`` for Lightning. All three
write through ``integrations.recorder.Recorder``, so the report judges them as its own runs."""
