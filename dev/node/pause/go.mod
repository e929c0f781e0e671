// The sandbox ("pause") container of the local node's Pods: see dev/build-node-images.sh.
module rebound.dev/dev/node/pause

go 1.26.0
