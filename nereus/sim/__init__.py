"""The simulator behind ``nereus simulate``: policies side by side on a trace (``policies.py``).

``POLICY_NAMES``: the policies in the order they are reported (``policies.POLICIES`` holds them).
"""

POLICY_NAMES = ("fixed", "fixed-dp", "verl", "openrlhf", "nereus", "oracle")
TRUTH_NAMES = ("event", "hidden", "long-gen", "slow-inter", "formula")  # ``simulated_cluster.TRUTHS``, as offered
