"""Layer 4: variables on the ps tasks: sharded variables and row updates.
"""
