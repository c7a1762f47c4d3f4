"""A package of your own that holds policies: ``--policy mypkg.policies:greedy``."""
