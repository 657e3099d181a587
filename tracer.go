package idempotency

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Tracer observes the calls of a [Store], whatever their transport, for
// metrics, traces and logs; set it with [WithTracer]. Like pgx's tracers,
// TraceCallStart returns the context the call goes on with (holding a span,
// say) and TraceCallEnd gets what happened, on that context. Both run on
// the call's goroutine: keep them fast. The OpenTelemetry adapter in
// github.com/exactlyonce/idempotency/idempotencyotel is one.
//
// Every call a transport handles is traced, rejected ones included; calls
// that pass through (no key where none is needed) are not.
//
// A panic in a Tracer's method never reaches the call, nor the cleaner: it
// is recovered, the call goes on and ends as it would have, and the first
// panic of a store's tracer is logged with its stack through the default
// log/slog logger (slog.Default). A call whose TraceCallStart panicked is
// not traced further (its TraceCallEnd is not called: it would end a span
// that was never begun).
type Tracer interface {
	TraceCallStart(ctx context.Context, data TraceCallStartData) context.Context
	TraceCallEnd(ctx context.Context, data TraceCallEndData)
}

// CleanerTracer is a [Tracer] that also observes the expiry cleaner.
type CleanerTracer interface {
	TraceCleanerBatch(ctx context.Context, data TraceCleanerBatchData)
}

// Transport names what a call came through.
type Transport string

// Transports of [TraceCallStartData].
const (
	TransportGRPC Transport = "grpc"
	// TransportConnect is a unary call of a connect-go handler
	// (idempotencyconnect), whichever of its protocols it came by.
	TransportConnect Transport = "connect"
	TransportHTTP    Transport = "http"
	TransportMessage Transport = "message"
	// TransportStep is the kind of a step's record (see Step), in
	// Record.Steps and from Inspect of "step KEY".
	TransportStep Transport = "step"
	// TransportDirect is a call of [Store.Execute] by the application.
	TransportDirect Transport = "direct"
)

// TraceCallStartData is what is known of a call when it starts.
type TraceCallStartData struct {
	Transport Transport
	// Method is the gRPC full method ("/pkg.Service/Method"); for HTTP,
	// the request method and the route's template ("POST
	// /v1/orders/{id}"; see [WithHTTPRoute]), or the request method alone
	// when the route is not known, never the path, so that a label or a
	// span name taken from it stays bounded; empty for a message (see
	// Scope); or Call.Method.
	Method string
	// Scope is the call's key scope: a message's Scope from the start; for
	// the other transports, whose scope is decided once the call has
	// started ([WithScope], [WithHTTPScope], Call.Scope), only in
	// TraceCallEnd, and empty for a call refused before. It can name a
	// tenant, one of thousands: keep it off metric labels.
	Scope string
	// Key is the call's idempotency key, or message ID, as the client sent
	// it (maybe invalid, maybe empty). It can be a secret (a payment's
	// token, say): keep it out of logs and metrics.
	Key string
	// Attempt is which of its client's attempts a gRPC or connect call is,
	// as the client marked it (the retry interceptors' x-retry-attempt,
	// gRPC's grpc-previous-rpc-attempts): 1 for a call with no mark; 0 for
	// the transports whose clients mark nothing (HTTP, messages, Execute).
	Attempt int
}

// TraceCallEndData is what became of a call. The durations add up to less
// than Duration: the rest is the transport's own work and the pool.
type TraceCallEndData struct {
	TraceCallStartData
	Outcome Outcome
	// Err is the error the caller got, or nil.
	Err error
	// Duration is the whole call as its transport saw it.
	Duration time.Duration
	// Claim is the time spent taking the key and looking it up, over all
	// attempts (a duplicate's probes included).
	Claim time.Duration
	// Wait is the time spent waiting, outside the database, for another
	// call that held the key.
	Wait time.Duration
	// Handler is the time the handler (Func) ran.
	Handler time.Duration
	// Commit is the time spent storing the result and committing.
	Commit time.Duration
	// HTTPStatus is the status an HTTP call answered with (0 for other
	// transports, and when the client had gone).
	HTTPStatus int
}

// TraceCleanerBatchData is one batch of the expiry cleaner.
type TraceCleanerBatchData struct {
	// Deleted is the number of expired keys the batch deleted.
	Deleted int64
	// Duration is how long the batch took.
	Duration time.Duration
	// Pause is how long the cleaner waits before its next batch: nine
	// times Duration after a full batch of a round ([Store.RunCleaner],
	// [Store.DeleteExpired]); zero after a round's last batch.
	Pause time.Duration
	// Err is the batch's error, or nil.
	Err error
}

// WithTracer sets the store's [Tracer]. It must not be nil. A panic in
// it is recovered and the first one logged to slog.Default (see
// [Tracer]). Defaults to none.
func WithTracer(t Tracer) StoreOption {
	return func(o *storeOptions) {
		if t == nil { // nil is how the options say "no tracer"
			o.err = fmt.Errorf("idempotency: WithTracer: tracer is nil")
			return
		}
		o.tracer = &guardedTracer{Tracer: t}
	}
}

// guardedTracer is the store's tracer as WithTracer keeps it: every call of
// its methods recovers a panic, so that a bug in metrics code never crashes
// the server, fails a call or changes its outcome.
type guardedTracer struct {
	Tracer
	logged atomic.Bool // the first panic has been logged
}

// start calls TraceCallStart; ok is false when it panicked.
func (g *guardedTracer) start(ctx context.Context, data TraceCallStartData) (traced context.Context, ok bool) {
	defer g.recover("TraceCallStart")
	return g.TraceCallStart(ctx, data), true
}

// end calls TraceCallEnd.
func (g *guardedTracer) end(ctx context.Context, data TraceCallEndData) {
	defer g.recover("TraceCallEnd")
	g.TraceCallEnd(ctx, data)
}

// cleanerBatch calls TraceCleanerBatch, if the tracer has it.
func (g *guardedTracer) cleanerBatch(ctx context.Context, data TraceCleanerBatchData) {
	if ct, ok := g.Tracer.(CleanerTracer); ok {
		defer g.recover("TraceCleanerBatch")
		ct.TraceCleanerBatch(ctx, data)
	}
}

// recover, deferred, stops a panic of the tracer's method and logs the
// first. Once is enough for an operator to find the bug, and a tracer that
// panics on every call would otherwise log on every call.
func (g *guardedTracer) recover(method string) {
	p := recover()
	if p == nil || !g.logged.CompareAndSwap(false, true) {
		return
	}
	slog.Default().Error("idempotency: the store's Tracer panicked in "+method+"; the call went on and ended as it would have, "+
		"with its tracing cut short. Fix the tracer: later panics of it are recovered without a log",
		"method", method, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
}

// LogTracer returns a [Tracer] that logs one line per call's end to logger
// (slog.Default() when nil), for a service that wants its calls in its
// log: the transport, the method (or HTTP route), the scope, the client's
// attempt, the outcome, the duration and, for a call that ended in an
// error, its gRPC code and message (an HTTP call's status too). The level
// says who must act:
//
//   - Info: the call was answered, executed or replayed, a decided
//     failure (NotFound, FailedPrecondition, ...) included;
//   - Warn: it was not, and the client retries or corrects it (released,
//     in progress, unavailable, key reused, rejected, canceled);
//   - Error: an operator must look: a failure stored for good that no
//     one decided (Internal, Unknown or DataLoss, such as a handler that
//     ended the call's transaction, or an HTTP 5xx stored), and a store
//     that cannot work as configured (misconfigured).
//
// It never logs the key, which can be a secret (a payment's token, say)
// and which a log reader can replay with; an error's message that quotes
// it has it replaced with "<key>". A service that wants keys in its log
// logs them where it knows they are no secret, with [IncomingKey].
//
// Join it with a metrics tracer with [JoinTracers].
func LogTracer(logger *slog.Logger) Tracer { return logTracer{logger: logger} }

type logTracer struct {
	logger *slog.Logger
}

func (l logTracer) TraceCallStart(ctx context.Context, _ TraceCallStartData) context.Context {
	return ctx
}

func (l logTracer) TraceCallEnd(ctx context.Context, data TraceCallEndData) {
	logger := l.logger
	if logger == nil {
		logger = slog.Default()
	}
	level := logLevel(data)
	if !logger.Enabled(ctx, level) {
		return
	}
	attrs := make([]slog.Attr, 0, 9)
	attrs = append(attrs, slog.String("transport", string(data.Transport)))
	if data.Method != "" {
		attrs = append(attrs, slog.String("method", data.Method))
	}
	if data.Scope != "" {
		attrs = append(attrs, slog.String("scope", data.Scope))
	}
	if data.Attempt > 0 {
		attrs = append(attrs, slog.Int("attempt", data.Attempt))
	}
	attrs = append(attrs, slog.String("outcome", data.Outcome.String()), slog.Duration("duration", data.Duration))
	if data.HTTPStatus != 0 {
		attrs = append(attrs, slog.Int("http_status", data.HTTPStatus))
	}
	if data.Err != nil {
		msg := data.Err.Error()
		if data.Key != "" {
			msg = strings.ReplaceAll(msg, strconv.Quote(data.Key), `"<key>"`)
		}
		attrs = append(attrs, slog.String("code", status.Code(data.Err).String()), slog.String("error", msg))
	}
	logger.LogAttrs(ctx, level, "idempotency call", attrs...)
}

// logLevel is the level of a call's line in [LogTracer].
func logLevel(data TraceCallEndData) slog.Level {
	switch data.Outcome {
	case OutcomeExecuted:
		switch status.Code(data.Err) {
		case codes.Internal, codes.Unknown, codes.DataLoss:
			return slog.LevelError
		}
		if data.HTTPStatus >= 500 {
			return slog.LevelError
		}
		return slog.LevelInfo
	case OutcomeReplayed:
		return slog.LevelInfo
	case OutcomeMisconfigured:
		return slog.LevelError
	}
	return slog.LevelWarn
}

// JoinTracers returns a [Tracer] that calls each of ts: TraceCallStart in
// order, each on the context the one before returned, TraceCallEnd in the
// reverse order, and TraceCleanerBatch of those that are [CleanerTracer]s.
// A panic in one of them stops the rest of that method's calls: as the
// store's tracer, a join whose TraceCallStart panicked is not called at the
// call's end (see [Tracer]).
func JoinTracers(ts ...Tracer) Tracer { return tracers(ts) }

type tracers []Tracer

func (ts tracers) TraceCallStart(ctx context.Context, data TraceCallStartData) context.Context {
	for _, t := range ts {
		ctx = t.TraceCallStart(ctx, data)
	}
	return ctx
}

func (ts tracers) TraceCallEnd(ctx context.Context, data TraceCallEndData) {
	for i := len(ts) - 1; i >= 0; i-- {
		ts[i].TraceCallEnd(ctx, data)
	}
}

func (ts tracers) TraceCleanerBatch(ctx context.Context, data TraceCleanerBatchData) {
	for _, t := range ts {
		if ct, ok := t.(CleanerTracer); ok {
			ct.TraceCleanerBatch(ctx, data)
		}
	}
}

// callTrace follows one call from its transport's start to its end.
type callTrace struct {
	tracer *guardedTracer
	start  time.Time
	data   TraceCallEndData
}

// startCall starts tracing a call; it returns ctx unchanged and a nil trace
// when the store has no tracer, or its TraceCallStart panicked. Methods of
// a nil *callTrace do nothing.
func (s *Store) startCall(ctx context.Context, transport Transport, method, key string) (context.Context, *callTrace) {
	return s.startTrace(ctx, TraceCallStartData{Transport: transport, Method: method, Key: key})
}

// startTrace is startCall with the whole of what is known.
func (s *Store) startTrace(ctx context.Context, start TraceCallStartData) (context.Context, *callTrace) {
	g, _ := s.opts.tracer.(*guardedTracer) // WithTracer sets no other
	if g == nil {
		return ctx, nil
	}
	traced, ok := g.start(ctx, start)
	if !ok {
		return ctx, nil
	}
	return traced, &callTrace{tracer: g, start: time.Now(), data: TraceCallEndData{TraceCallStartData: start}}
}

// setScope records the call's scope, once decided.
func (t *callTrace) setScope(scope string) {
	if t != nil {
		t.data.Scope = scope
	}
}

// setHTTPStatus records the status an HTTP call answered with.
func (t *callTrace) setHTTPStatus(status int) {
	if t != nil {
		t.data.HTTPStatus = status
	}
}

// endDeferred, deferred by a transport once its trace has started, ends the
// trace with the call's outcome and error as the transport returns them;
// a panic is reported as released, then goes on.
func (t *callTrace) endDeferred(ctx context.Context, outcome *Outcome, err *error) {
	if p := recover(); p != nil {
		t.end(ctx, OutcomeReleased, fmt.Errorf("panic: %v", p))
		panic(p)
	}
	t.end(ctx, *outcome, *err)
}

// end reports the call's outcome.
func (t *callTrace) end(ctx context.Context, o Outcome, err error) {
	if t == nil {
		return
	}
	t.data.Outcome, t.data.Err, t.data.Duration = o, err, time.Since(t.start)
	t.tracer.end(ctx, t.data)
}

// phase is a part of a call whose time is traced.
type phase int

const (
	phaseClaim phase = iota
	phaseWait
	phaseHandler
	phaseCommit
)

// now is when a traced phase starts: the zero time, without reading the
// clock, when there is no tracer.
func (t *callTrace) now() time.Time {
	if t == nil {
		return time.Time{}
	}
	return time.Now()
}

// since adds the time since start to the phase's duration.
func (t *callTrace) since(p phase, start time.Time) {
	if t == nil {
		return
	}
	d := time.Since(start)
	switch p {
	case phaseClaim:
		t.data.Claim += d
	case phaseWait:
		t.data.Wait += d
	case phaseHandler:
		t.data.Handler += d
	case phaseCommit:
		t.data.Commit += d
	}
}
