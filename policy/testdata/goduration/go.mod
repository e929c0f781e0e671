module rebound.dev/goduration

go 1.22
