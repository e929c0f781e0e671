'use strict';
// Paths into the repository the package lives in (tests read the shared vectors and proto).
const path = require('node:path');

const REPO = path.resolve(__dirname, '..', '..', '..', '..');
module.exports = {
  REPO,
  VECTORS: path.join(REPO, 'policy', 'testdata', 'decide-vectors.json'),
  ASSIGN_VECTORS: path.join(REPO, 'policy', 'testdata', 'assign-vectors.json'),
  REPO_PROTO_DIR: path.join(REPO, 'proto', 'rebound', 'v1'),
  PKG_PROTO_DIR: path.join(__dirname, '..', '..', 'proto', 'rebound', 'v1'),
};
