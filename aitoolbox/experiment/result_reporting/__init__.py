"""Human-readable reports of an experiment: the hyperparameter list, the source code, history plots and tables."""
