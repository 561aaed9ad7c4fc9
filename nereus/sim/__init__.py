"""The simulator behind ``nereus simulate``: policies side by side on a trace (``policies.py``).

``POLICY_NAMES``: the policies in the order they are reported (``policies.POLICIES`` holds them).
"""

POLICY_NAMES = ("fixed", "fixed-dp", "verl", "openrlhf", "nereus", "oracle")
