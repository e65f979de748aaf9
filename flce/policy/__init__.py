"""The RL policy losses (the GRPO/PPO family) over flce's row statistics.

``options`` holds the loss's scalar settings (:class:`~flce.policy.options.PolicyObjective`), ``tokens`` its
per-token tensors flattened for the engine, ``semantics`` the formula (the per-token loss, its derivatives with
respect to each token's log-prob and entropy, the aggregations and the metrics), ``checks`` the user tensors turned
into those, and ``api`` the public functions (``flce.linear_policy_loss``, ``flce.get_policy_impl``)."""
