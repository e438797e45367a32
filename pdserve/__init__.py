"""The `pdserve` command: starts every process kind (router, prefill and decode workers,
`pdserve up`). It sits above services/ and router/ so neither imports the other, and it
imports a subcommand's package only when that subcommand runs: the router image has
neither torch nor services/ nor kvtransfer/."""
