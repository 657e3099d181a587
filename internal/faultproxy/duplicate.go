package faultproxy

import (
	"bufio"
	"context"
	"time"
)

const (
	// maxRecord bounds the bytes kept per connection for replays; header
	// blocks must be kept for the life of the connection because HPACK state
	// depends on all of them.
	maxRecord = 1 << 20
	// duplicateTimeout bounds a replay connection so a server that never
	// answers cannot keep it, and Close, waiting.
	duplicateTimeout = 10 * time.Second
)

// headerBlock is one HEADERS frame and its CONTINUATION frames.
type headerBlock struct {
	stream uint32
	raw    []byte
}

// pendingDup is a request stream chosen for duplication whose request has
// not fully arrived yet.
type pendingDup struct {
	data  []byte
	ended bool
}

// recorder keeps what is needed to replay a request stream of one client
// connection on a fresh upstream connection. It is used by a single
// goroutine.
type recorder struct {
	enabled  bool
	size     int
	settings []byte
	blocks   []headerBlock
	// inBlock is set while the last header block still awaits CONTINUATION
	// frames; a replay must not cut a header block in half.
	inBlock bool
	chosen  map[uint32]*pendingDup
}

func newRecorder() *recorder {
	return &recorder{enabled: true, chosen: make(map[uint32]*pendingDup)}
}

// choose marks stream for duplication.
func (r *recorder) choose(stream uint32) {
	if r.enabled {
		r.chosen[stream] = &pendingDup{}
	}
}

// observe records f and, when f completes a chosen request stream, returns
// the bytes to replay on a new connection along with that stream's id.
func (r *recorder) observe(f *frame) ([]byte, uint32) {
	if !r.enabled {
		return nil, 0
	}
	pd := r.chosen[f.stream]
	switch f.typ {
	case frameSettings:
		// ACKs answer the original server's SETTINGS; the replay connection's
		// SETTINGS are acknowledged by the duplicate reader instead.
		if f.stream == 0 && f.flags&flagAck == 0 {
			r.settings = append(r.settings, f.raw...)
			r.size += len(f.raw)
		}
	case frameHeaders:
		r.blocks = append(r.blocks, headerBlock{stream: f.stream, raw: append([]byte(nil), f.raw...)})
		r.size += len(f.raw)
		r.inBlock = f.flags&flagEndHeaders == 0
		if pd != nil && f.flags&flagEndStream != 0 {
			pd.ended = true
		}
	case frameContinuation:
		if r.inBlock && len(r.blocks) > 0 && r.blocks[len(r.blocks)-1].stream == f.stream {
			last := &r.blocks[len(r.blocks)-1]
			last.raw = append(last.raw, f.raw...)
			r.size += len(f.raw)
			r.inBlock = f.flags&flagEndHeaders == 0
		}
	case frameData:
		if pd != nil {
			pd.data = append(pd.data, f.raw...)
			r.size += len(f.raw)
			if f.flags&flagEndStream != 0 {
				pd.ended = true
			}
		}
	case frameRSTStream:
		// The client abandoned the request; replaying it would be invented
		// traffic rather than a duplicate.
		delete(r.chosen, f.stream)
		pd = nil
	}
	if r.size > maxRecord {
		*r = recorder{}
		return nil, 0
	}
	if pd == nil || !pd.ended || r.inBlock {
		return nil, 0
	}
	delete(r.chosen, f.stream)
	return r.build(f.stream, pd), f.stream
}

// build assembles the replay for stream: preface, SETTINGS, every header
// block in order (others neutralized with RST_STREAM so the server's HPACK
// decoder stays in sync without running their handlers), then the stream's
// DATA.
func (r *recorder) build(stream uint32, pd *pendingDup) []byte {
	out := make([]byte, 0, len(clientPreface)+len(r.settings)+len(pd.data)+64*len(r.blocks))
	out = append(out, clientPreface...)
	out = append(out, r.settings...)
	reset := make(map[uint32]bool)
	for _, b := range r.blocks {
		start := len(out)
		out = append(out, b.raw...)
		if b.stream == stream {
			continue
		}
		// Byte 4 of the first frame is the HEADERS frame's flags.
		out[start+4] &^= flagEndStream
		if !reset[b.stream] {
			reset[b.stream] = true
			out = appendRSTStream(out, b.stream, errCodeCancel)
		}
	}
	return append(out, pd.data...)
}

// duplicate sends replay on a new upstream connection and waits for the
// server to finish the replayed stream, discarding its response.
func (p *Proxy) duplicate(replay []byte, stream uint32) {
	defer p.wg.Done()
	ctx, cancel := context.WithTimeout(p.ctx, duplicateTimeout)
	defer cancel()
	conn, err := p.dialer.DialContext(ctx, "tcp", p.target)
	if err != nil {
		return
	}
	if !p.track(conn) {
		_ = conn.Close()
		return
	}
	defer p.untrack(conn)
	defer conn.Close()
	if deadline, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(deadline)
	}
	if _, err := conn.Write(replay); err != nil {
		return
	}
	p.requestsDuplicated.Add(1)

	r := bufio.NewReaderSize(conn, bufSize)
	var fr frame
	var reply []byte
	for {
		if err := fr.read(r); err != nil {
			return
		}
		reply = reply[:0]
		switch fr.typ {
		case frameSettings:
			if fr.flags&flagAck == 0 {
				reply = appendFrame(reply, frameSettings, flagAck, 0, nil)
			}
		case framePing:
			if fr.flags&flagAck == 0 {
				reply = appendFrame(reply, framePing, flagAck, 0, fr.raw[frameHeaderLen:])
			}
		case frameData:
			// Return connection-level credit so a large response cannot stall
			// the server before it finishes the stream.
			if fr.length > 0 {
				reply = appendWindowUpdate(reply, 0, fr.length)
			}
		case frameGoAway:
			return
		}
		if len(reply) > 0 {
			if _, err := conn.Write(reply); err != nil {
				return
			}
		}
		if fr.stream == stream && fr.endsStream() {
			return
		}
	}
}
