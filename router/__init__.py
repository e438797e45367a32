"""The OpenAI-compatible HTTP front door of pdserve: validates requests, pairs each with
a prefill and a decode worker, relays the decode worker's tokens as OpenAI responses.

Imports only aiohttp, grpc, protobuf, prometheus_client and pdpb (never torch)."""
