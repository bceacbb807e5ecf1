"""What the router and the engine roles agree on beyond the .proto messages.

Initial metadata an engine sends once it has taken a request in. The router
retries a failed call on another instance only when this never arrived
(connection refused, a draining or dead engine, a full queue): a request an
engine took and then failed on is not sent on, since it could fail the next
engine the same way.
"""
ADMITTED_METADATA = (("tandem-admitted", "1"),)
