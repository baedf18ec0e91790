"""Other libraries' Python APIs served by moelink, so that their users switch by changing imports.

- ``moelink.compat.mooncake``: Mooncake's process-group functions (``mooncake.pg``) and EP buffer
  (``mooncake.mooncake_ep_buffer.Buffer``) over backend ``"ep"``; the README's "Coming from
  Mooncake" table lists where the semantics differ.
"""
