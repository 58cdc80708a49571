"""Mixture-of-Experts: the routed MLP layer, its config, and the router losses and figures."""
