# frozen_string_literal: true

require "minitest/autorun"
require "json"

REPO = File.expand_path("../../..", __dir__)
$LOAD_PATH.unshift(File.expand_path("../lib", __dir__))
