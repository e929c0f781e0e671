# frozen_string_literal: true

# Rebound for Sidekiq: `require "rebound/sidekiq"` loads the retry hook
# (rebound/hook) and offers the optional fetch that keeps a killed process's jobs.
require "rebound/hook"

module Rebound
  module Sidekiq
    # Fetch jobs with Rebound::Sidekiq::ReliableFetch in this server process, so that a
    # job running in a killed process runs again (call it in the file `sidekiq -r` loads).
    def self.reliable_fetch!
      require "rebound/reliable_fetch"
      ReliableFetch.install
    end
  end
end
