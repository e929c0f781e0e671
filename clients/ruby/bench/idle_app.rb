# frozen_string_literal: true

# The app bench/idle_fetch.rb runs in idle `sidekiq` processes: no jobs, only the fetch
# named by BENCH_FETCH (basic: Sidekiq's BRPOP; rebound: Rebound::Sidekiq::ReliableFetch;
# gitlab / gitlab-semi: ruby-gitlab-sidekiq-fetcher 0.8's reliable and semi-reliable modes).
require "sidekiq"

case ENV.fetch("BENCH_FETCH")
when "basic" then nil
when "rebound"
  require "rebound/reliable_fetch"
  Rebound::Sidekiq.reliable_fetch!
when "gitlab", "gitlab-semi"
  require "sidekiq-reliable-fetch"
  Sidekiq.configure_server do |config|
    config.options[:semi_reliable_fetch] = ENV["BENCH_FETCH"] == "gitlab-semi"
    Sidekiq::ReliableFetch.setup_reliable_fetch!(config)
  end
else abort "BENCH_FETCH: basic, rebound, gitlab or gitlab-semi"
end
