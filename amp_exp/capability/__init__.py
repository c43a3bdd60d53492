"""What is fast here: the probe's kernel times and their cache, the device's verdicts and the
recommendation drawn from the speed trial, and precision=auto, which decides by that trial."""
