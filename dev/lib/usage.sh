# The usage text of a dev/ script is its header comment. Sourced, not executed.

# shellcheck shell=bash

# Prints the comment block at the top of SCRIPT (after the shebang, up to the first line
# that is not a comment), without the leading "# ".
usage_from_header() {
  awk 'NR == 1 && /^#!/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$1"
}
