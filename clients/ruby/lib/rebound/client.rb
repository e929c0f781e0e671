# frozen_string_literal: true

require "grpc"
require "rebound/v1/advisor_services_pb"

module Rebound
  # Raised when the worker is configured or started with a malformed sidecar address
  # (REBOUND_TARGET): before any job runs, never on the retry path.
  class ConfigurationError < ArgumentError; end

  # The gRPC client of rebound.v1.RetryAdvisor: one channel per process, made on first use.
  #
  # A gRPC channel must not cross fork, so the stub is remembered with the PID that made it
  # and a new one is made in a forked child (the parent's is abandoned, never used there).
  # Ruby gRPC stubs are safe to share between threads.
  class Client
    TARGET_RE = /\A(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):\d{1,5}\z/.freeze
    CHANNEL_ARGS = {
      # Reconnect bounded: back on a restarted sidecar within about a second.
      "grpc.initial_reconnect_backoff_ms" => 100,
      "grpc.min_reconnect_backoff_ms" => 100,
      "grpc.max_reconnect_backoff_ms" => 1000,
      "grpc.enable_retries" => 0,
      "grpc.keepalive_time_ms" => 30_000,
    }.freeze

    attr_reader :target, :deadline_s

    # Accepts "unix:///abs/path.sock", "unix:/abs/path" and "host:port" (port 1-65535).
    # nil when the target is well formed, else what is wrong with it.
    def self.target_error(target)
      return "not a string" unless target.is_a?(String)
      if target.start_with?("unix:")
        path = target.sub(%r{\Aunix://}, "").sub(/\Aunix:/, "")
        return path.start_with?("/") ? nil : "#{target.inspect} is not \"unix:///absolute/path.sock\""
      end
      m = TARGET_RE.match(target)
      return "#{target.inspect} is not \"unix:///path/to.sock\" or \"HOST:PORT\" (no scheme)" unless m
      port = target[/:(\d+)\z/, 1].to_i
      return "port #{port} is out of range 1-65535" unless port.between?(1, 65_535)
      nil
    end

    def self.check_target(target)
      err = target_error(target)
      raise ConfigurationError, "target: #{err}" if err
      target
    end

    def initialize(target, deadline_s)
      @target = self.class.check_target(target)
      @deadline_s = deadline_s
      @lock = Mutex.new
      @pid = nil
      @stub = nil
    end

    def decide(request)
      stub.decide(request, deadline: Time.now + @deadline_s)
    end

    def get_policy(queue)
      stub.get_policy(V1::GetPolicyRequest.new(queue: queue), deadline: Time.now + @deadline_s)
    end

    def close
      @lock.synchronize do
        @stub&.instance_variable_get(:@ch)&.close if @pid == Process.pid
        @stub = nil
      end
    rescue StandardError
      nil
    end

    private

    def stub
      @lock.synchronize do
        if @stub.nil? || @pid != Process.pid
          @stub = V1::RetryAdvisor::Stub.new(@target, :this_channel_is_insecure, channel_args: CHANNEL_ARGS)
          @pid = Process.pid
        end
        @stub
      end
    end
  end
end
