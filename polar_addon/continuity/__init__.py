"""Token continuity: a session's next engine prompt is its previous prompt + the sampled ids + only the new messages'
tokens, so the whole session stays one exactly on-policy trace.

- :mod:`polar_addon.continuity.check`: does a call continue the previous call of its session, message for message
  (or why it diverges)?
- :mod:`polar_addon.continuity.delta`: the next prompt in tokens, the new messages rendered as a delta with the
  model's own chat template.
- :mod:`polar_addon.continuity.chains`: the gateway's bookkeeping, each session's chain tips and the prompt plan of
  its next call, and the ``polar_tito`` gate.

Nothing is imported here: the engines import ``delta`` and ``chains`` imports the engines.
"""
