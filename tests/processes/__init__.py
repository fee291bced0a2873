"""Real processes: gloo ranks with real DeepSpeed and DeepCompile, the launchers users have, and the repository's
commands that start them. Minutes on two cores."""
