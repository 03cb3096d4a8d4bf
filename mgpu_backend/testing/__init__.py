"""Tiny random-weight models in the real file layouts: for the tests and the CLI's demo / make-tiny only; runtime code never imports this package."""
