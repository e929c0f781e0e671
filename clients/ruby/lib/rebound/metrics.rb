# frozen_string_literal: true

module Rebound
  # The adapter's Prometheus counters: the rebound_adapter_* contract every Rebound adapter
  # shares (clients/conformance/README.md "Metrics"), adapter="sidekiq". Off until the
  # application calls Rebound::Metrics.enable (a Prometheus::Client registry) or
  # Rebound::Metrics.enable_yabeda.
  module Metrics
    ADAPTER = "sidekiq"
    # name => [help, label names], the same in every language's adapter.
    COUNTERS = {
      decisions: ["rebound_adapter_decisions_total", "Retry decisions the hook used, by who answered.", %i[adapter source]],
      fallbacks: ["rebound_adapter_fallbacks_total", "Decisions made without the sidecar, by cause and the policy used.",
        %i[adapter reason policy_source]],
      terminal: ["rebound_adapter_terminal_total", "Jobs the adapter dead-lettered or dropped.", %i[adapter disposition]],
      hook_errors: ["rebound_adapter_hook_errors_total", "Faults inside the adapter that it absorbed.", %i[adapter]]
    }.freeze
    REASONS = %w[unavailable deadline_exceeded not_found other].freeze
    # Every series, created at 0 when enabled, so rate() sees the first increment.
    SERIES = [
      *%w[sidecar fallback].map { |s| [:decisions, {source: s}] },
      *REASONS.product(%w[cached default]).map { |r, p| [:fallbacks, {reason: r, policy_source: p}] },
      *%w[dead_letter drop].map { |d| [:terminal, {disposition: d}] },
      [:hook_errors, {}]
    ].freeze

    # Increments counters of one registry API. The prometheus-client gem (>= 2) takes
    # keywords (`counter(:n, docstring:, labels:)`, `increment(by:, labels:)`);
    # prometheus-client-mmap and prometheus-client < 2 take positions
    # (`counter(:n, "help")`, `increment(labels, by)`).
    class Sink
      def initialize(registry)
        unless registry.respond_to?(:counter) && registry.respond_to?(:get)
          raise ArgumentError, "registry: must be a Prometheus::Client::Registry (got #{registry.class})"
        end
        @keywords = registry.method(:counter).parameters.any? { |kind, name| %i[key keyreq].include?(kind) && name == :docstring }
        @counters = COUNTERS.to_h do |key, (name, help, labels)|
          existing = registry.get(name.to_sym)
          counter = existing || if @keywords
            registry.counter(name.to_sym, docstring: help, labels: labels)
          else
            registry.counter(name.to_sym, help)
          end
          [key, counter]
        end
      end

      def increment(key, labels, by)
        labels = {adapter: ADAPTER}.merge(labels)
        @keywords ? @counters[key].increment(by: by, labels: labels) : @counters[key].increment(labels, by)
      end
    end

    # Yabeda's API (yabeda gem): counters declared in the group :rebound before
    # Yabeda.configure! runs, incremented with `increment(tags, by:)`.
    class YabedaSink
      def initialize
        COUNTERS.each_value do |name, help, labels|
          short = name.delete_prefix("rebound_").to_sym
          ::Yabeda.configure { group(:rebound) { counter(short, comment: help, tags: labels) } }
        end
      end

      def increment(key, labels, by)
        ::Yabeda.rebound.public_send(COUNTERS[key][0].delete_prefix("rebound_")).increment({adapter: ADAPTER}.merge(labels), by: by)
      end
    end

    @lock = Mutex.new
    @sink = nil

    class << self
      # Counts into `registry` from now on (default: Prometheus::Client.registry), in this
      # process. A second call changes nothing. Raises ArgumentError naming `registry` for a
      # value that is not one.
      def enable(registry = nil)
        @lock.synchronize do
          return if @sink
          if registry.nil?
            require "prometheus/client"
            registry = ::Prometheus::Client.registry
          end
          sink = Sink.new(registry)
          SERIES.each { |key, labels| sink.increment(key, labels, 0) }
          @sink = sink
        end
      end

      # Counts through Yabeda (call it before Yabeda.configure!).
      def enable_yabeda
        @lock.synchronize { @sink ||= YabedaSink.new }
      end

      def enabled?
        !@sink.nil?
      end

      def decision(source)
        increment(:decisions, source: source)
      end

      def fallback(reason, policy_source)
        increment(:fallbacks, reason: REASONS.include?(reason) ? reason : "other", policy_source: policy_source)
      end

      def terminal(disposition)
        increment(:terminal, disposition: disposition)
      end

      def hook_error
        increment(:hook_errors)
      end

      # Never raises: counting must not break the retry path.
      def increment(key, labels = {})
        @sink&.increment(key, labels, 1)
      rescue StandardError
        nil
      end
    end
  end
end
