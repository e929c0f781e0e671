# frozen_string_literal: true

# The committed stubs are what Debian's grpc_tools_ruby_protoc makes of proto/ now
# (regenerate: clients/ruby/gen-stubs.sh).
require_relative "test_helper"
require "tmpdir"

class StubsTest < Minitest::Test
  def test_committed_stubs_match_the_repository_proto
    Dir.mktmpdir do |out|
      Harness.run!(File.join(REPO, "clients", "ruby", "gen-stubs.sh"), out)
      %w[advisor_pb.rb advisor_services_pb.rb].each do |f|
        assert_equal File.read(File.join(out, "rebound", "v1", f)), File.read(File.join(LIB, "rebound", "v1", f)), "#{f} is stale: run clients/ruby/gen-stubs.sh"
      end
    end
  end
end
